"""Images opened header first: their size is known, and checked, before any pixel is decoded."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image, ImageOps

from vlm_assets.catalog.media import open_media

# Pillow's decompression-bomb guard is one process-wide number (a warning above 89 M pixels, an
# error above 179 M) that knows no source. Each source's `max_image_pixels` replaces it: the
# catalogue refuses a larger image from its header, before decoding it, with a reason naming that
# key, and later steps open only images the catalogue accepted.
Image.MAX_IMAGE_PIXELS = None


@contextmanager
def opened_image(ref: str) -> Iterator[Image.Image]:
    """The image at `ref` with its header read (size, mode, metadata) and no pixel decoded."""
    with open_media(ref) as handle, Image.open(handle) as image:
        yield image


class ImageTooLarge(str):
    """Why an image is refused before it is decoded: its size against the source's pixel limit."""

    @classmethod
    def of(cls, size: tuple[int, int], max_image_pixels: int) -> ImageTooLarge | None:
        width, height = size
        if width * height <= max_image_pixels:
            return None
        return cls(f"{width}×{height} ({width * height:,} pixels) is above sources[].max_image_pixels ({max_image_pixels:,})")


def decoded_rgb(ref: str) -> Image.Image:
    """The image's pixels as transformers' `load_image` returns them: EXIF orientation applied, RGB.

    `load_image` copies the image at each step (an RGB image is held three times while it runs);
    here each step works in place where Pillow can, so one decoded copy is left once it returns.
    """
    with opened_image(ref) as image:
        image.load()
        ImageOps.exif_transpose(image, in_place=True)
        return image if image.mode == "RGB" else image.convert("RGB")
