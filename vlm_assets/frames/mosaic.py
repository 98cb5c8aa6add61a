"""One JPEG per video: the sampled frames tiled row-major into a rows × cols grid."""

from __future__ import annotations

import io
from collections.abc import Iterable

import numpy as np
from PIL import Image


# RGB plus one unused byte per pixel is how Pillow holds an RGB image, so a canvas in that layout is
# encoded in place; a 3-byte canvas costs a conversion into Pillow's layout as long as the encode.
CANVAS_CHANNELS = 4


def mosaic_canvas_shape(rows: int, cols: int, size: int) -> tuple[int, int, int]:
    return rows * size, cols * size, CANVAS_CHANNELS


def mosaic_canvas(rows: int, cols: int, size: int) -> np.ndarray:
    return np.zeros(mosaic_canvas_shape(rows, cols, size), dtype=np.uint8)


def place_tile(canvas: np.ndarray, position: int, cols: int, tile: np.ndarray) -> None:
    """Write `tile` (RGB, or RGB plus a padding byte) into grid cell `position` (row-major)."""
    size = tile.shape[0]
    row, col = divmod(position, cols)
    canvas[row * size : (row + 1) * size, col * size : (col + 1) * size, : tile.shape[2]] = tile


def tile_frames(frames: Iterable[np.ndarray], rows: int, cols: int, size: int) -> np.ndarray:
    canvas = mosaic_canvas(rows, cols, size)
    for position, frame in enumerate(frames):
        place_tile(canvas, position, cols, frame)
    return canvas


def encode_jpeg(canvas: np.ndarray, quality: int) -> bytes:
    """JPEG of an RGB image held as height × width × 3 or × 4 (the fourth byte is ignored)."""
    buffer = io.BytesIO()
    mode = "RGBX" if canvas.shape[2] == CANVAS_CHANNELS else "RGB"
    # For RGBX, frombuffer wraps the canvas itself (28 MB for a 4×16 mosaic of 384 px); for RGB it converts.
    image = Image.frombuffer(mode, (canvas.shape[1], canvas.shape[0]), np.ascontiguousarray(canvas), "raw", mode, 0, 1)
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def split_mosaic(mosaic: np.ndarray, rows: int, cols: int, num_frames: int) -> np.ndarray:
    """(num_frames, H, W, 3) from a decoded rows × cols mosaic (RGB), undoing `tile_frames`."""
    height, width = mosaic.shape[0] // rows, mosaic.shape[1] // cols
    grid = mosaic.reshape(rows, height, cols, width, 3).transpose(0, 2, 1, 3, 4)
    return np.ascontiguousarray(grid.reshape(rows * cols, height, width, 3)[:num_frames])
