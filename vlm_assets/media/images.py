"""Images opened header first: their size is known, and checked, before any pixel is decoded."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image, ImageOps

from vlm_assets.media.refs import is_object_ref, object_facts, open_media

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


EXIF_ORIENTATION_TAG = 0x0112
ORIENTATIONS_THAT_SWAP_AXES = frozenset({5, 6, 7, 8})


def oriented_image_size(ref: str) -> tuple[int, int]:
    """(height, width) after EXIF orientation, read from the header without decoding pixels (of a
    pinned object, as the catalogue recorded it, without a request)."""
    recorded = object_facts(ref).image_size if is_object_ref(ref) else None
    if recorded is not None:
        return recorded
    with opened_image(ref) as image:
        width, height = image.size
        if image.format == "PNG" and not _png_metadata_after_pixels(ref):
            # Everything Pillow would read is already in `info`; PNG's own getexif() would decode the pixels.
            exif = Image.Image.getexif(image)
        else:
            exif = image.getexif()
        orientation = exif.get(EXIF_ORIENTATION_TAG, 1)
    if orientation in ORIENTATIONS_THAT_SWAP_AXES:
        width, height = height, width
    return height, width


PNG_METADATA_CHUNKS = frozenset({b"eXIf", b"iTXt", b"tEXt", b"zTXt"})


def _png_metadata_after_pixels(ref: str) -> bool:
    """True when a PNG stores EXIF/XMP-capable chunks after its pixel data (walks chunk headers only)."""
    with open_media(ref) as handle:
        handle.seek(8)
        seen_pixels = False
        while True:
            header = handle.read(8)
            if len(header) < 8:
                return False
            length, chunk_type = int.from_bytes(header[:4], "big"), header[4:8]
            if chunk_type == b"IDAT":
                seen_pixels = True
            elif chunk_type == b"IEND":
                return False
            elif seen_pixels and chunk_type in PNG_METADATA_CHUNKS:
                return True
            handle.seek(length + 4, 1)
