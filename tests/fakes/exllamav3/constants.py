"""``PAGE_SIZE``, the generator's fixed page size, as in the wheel's ``exllamav3/constants.py``."""

from __future__ import annotations

PAGE_SIZE = 256
