"""Media files: where their bytes are (refs), opening, sniffing and checking images and videos, decoding
video frames. Beneath the catalogue, the frame cache, token lengths and packing, which all read media."""
