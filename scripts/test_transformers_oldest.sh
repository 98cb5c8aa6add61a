#!/usr/bin/env bash
# Run the token-length tests under the oldest transformers release vlm-assets supports (the lower
# bound of its requirement in pyproject.toml); the main environment has the newest one. The oldest
# release goes into `.venv-transformers-oldest`, a small environment layered over `.venv`: its own
# transformers (and the tokenizers / huggingface-hub that release needs) first, everything else
# taken from `.venv`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null

oldest="$(.venv/bin/python - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(dep for dep in deps if re.match(r"transformers\b", dep))
print(re.search(r">=\s*([\w.]+)", spec).group(1))
PY
)"
layer=.venv-transformers-oldest
if [ "$("$layer/bin/python" -c 'import transformers; print(transformers.__version__)' 2>/dev/null)" != "$oldest" ]; then
  rm -rf "$layer"
  "${PYTHON:-python3}" -m venv "$layer"
  base="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  own="$("$layer/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  printf '%s\n%s\n' "$PWD" "$base" > "$own/vlm-assets-base.pth"
  # pip sees .venv's packages through the .pth file and adds only what this release needs otherwise
  # (it reports vlm-assets' own pin as a conflict, which is the point here).
  "$layer/bin/python" -m pip install --quiet --no-compile "transformers==$oldest" 2>&1 | grep -v "dependency resolver\|requires transformers" || true
  # Its bytecode on every core where Python will not write it, as scripts/setup.sh does for .venv.
  if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    "$layer/bin/python" -m compileall -q -j 0 -x '/tests?/' "$own" >/dev/null || true
  fi
fi

echo "== token-length tests under transformers $oldest"
# Without the `processes` tier: those tests pack the lengths into shards and load them through
# Energon, which does not depend on the transformers release; the lengths themselves are compared
# with direct processor calls by the tests that run here.
env -u VLM_ASSETS_PG_HOST "$layer/bin/python" -m pytest -q -m "not processes" -p no:cacheprovider \
  vlm_assets_tests/test_lengths.py vlm_assets_tests/test_family_lengths.py \
  vlm_assets_tests/test_processor_families.py vlm_assets_tests/test_embedded_processor.py \
  vlm_assets_tests/test_video_tokens.py vlm_assets_tests/test_chat_templates.py "$@"
