"""`uv pip install` into an environment with what this machine's pip configuration says.

Usage: python uv_pip_install.py UV PYTHON [uv pip install arguments...], run by the environment's
own Python, whose pip configuration (`pip config list`: indexes, find-links, constraints, trusted
hosts, certificate, timeout; its environment variables win over its files, as in pip) is handed to
uv, which reads none of it. Candidates are taken from every index, as pip takes them.
"""

import ast
import os
import subprocess
import sys

OPTIONS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
}
ENVIRONMENT = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT", "default-timeout": "UV_HTTP_TIMEOUT"}


def pip_settings() -> dict[str, str]:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                            check=True).stdout
    settings: dict[str, str] = {}
    for line in listed.splitlines():
        name, _, value = line.partition("=")
        scope, _, key = name.rpartition(".")
        if key not in settings or scope == ":env:":
            settings[key] = str(ast.literal_eval(value))
    return settings


def main() -> None:
    uv, python, *arguments = sys.argv[1:]
    settings = pip_settings()
    options = [word for key, option in OPTIONS.items() for value in settings.get(key, "").split()
               for word in (option, value)]
    environment = {**os.environ, **{name: settings[key] for key, name in ENVIRONMENT.items() if key in settings}}
    command = [uv, "pip", "install", "--python", python, "--index-strategy", "unsafe-best-match", *options, *arguments]
    try:
        os.execvpe(uv, command, environment)
    except OSError as error:
        sys.exit(f"cannot run uv ({uv}): {error.strerror}")


if __name__ == "__main__":
    main()
