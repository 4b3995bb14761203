"""Stand-in for exllamav3 1.6.5's ``ext.py`` and torch's JIT build under it (see ../README.md).

As the real one: a precompiled module ``exllamav3_ext`` found on the path is used
(``is_precompiled_extension_available``); else the extension is built into
``$TORCH_EXTENSIONS_DIR/exllamav3_ext``: no ``TORCH_CUDA_ARCH_LIST`` and no device fails with
exllamav3's message, no ``ninja`` or ``nvcc`` with torch's, a ``lock`` left by a killed build
is waited on (torch's ``FileBaton``), objects already built are kept, ``MAX_JOBS`` compilers
run at once, and the link writes ``exllamav3_ext.so``. A "library" is a file that starts with
``MAGIC``; anything else fails to load, as a corrupt ``.so`` would.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

extension_name = "exllamav3_ext"
MAGIC = b"STAND-IN exllamav3_ext\n"


def is_precompiled_extension_available() -> bool:
    spec = importlib.util.find_spec(extension_name)
    if not spec or not spec.origin or not spec.loader:
        return False
    return any(spec.origin.endswith(suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES)


def _log(line: str) -> None:
    path = os.environ.get("GPU_CHECK_STANDIN_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def _load(path: str) -> SimpleNamespace:
    with open(path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ImportError(f"{path}: invalid ELF header")
    return SimpleNamespace(__file__=path)


def _build() -> SimpleNamespace:
    arch = os.environ.get("TORCH_CUDA_ARCH_LIST", "")
    if arch in ("", "native"):
        raise RuntimeError(
            f"No CUDA device is visible to determine the architectures to build {extension_name} for. "
            'Set TORCH_CUDA_ARCH_LIST to the target architectures, e.g. TORCH_CUDA_ARCH_LIST="8.6;8.9+PTX"'
        )
    if shutil.which("ninja") is None:
        raise RuntimeError("Ninja is required to load C++ extensions")
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise OSError("CUDA_HOME environment variable is not set. Please set it to your CUDA install root.")
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    build = root / extension_name
    build.mkdir(parents=True, exist_ok=True)
    lock = build / "lock"
    while lock.exists():
        time.sleep(0.1)
    lock.touch()
    codes = [a.split("+")[0].replace(".", "") for a in arch.replace(",", ";").split(";") if a]
    gencode = [f"-gencode=arch=compute_{c},code=sm_{c}" for c in codes]
    sources = sorted((Path(__file__).parent / extension_name).glob("*.cu"))
    jobs = int(os.environ.get("MAX_JOBS") or os.cpu_count() or 1)
    (build / "build.ninja").write_text(f"# stand-in: {len(sources)} sources, {' '.join(gencode)}\n")
    todo = [s for s in sources if not (build / f"{s.stem}.cuda.o").exists()]
    print(f"[1/{len(todo) + 1}] building {len(todo)} of {len(sources)} objects, MAX_JOBS={jobs}", flush=True)
    _log(f"build MAX_JOBS={jobs} objects={len(todo)}")

    def compile_one(src: Path) -> None:
        out = build / f"{src.stem}.cuda.o"
        subprocess.run([nvcc, *gencode, "-c", str(src), "-o", str(out)], check=True)

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(compile_one, todo))
    size = int(os.environ.get("GPU_CHECK_STANDIN_SO_BYTES") or 256 * 1024)
    body = b"".join((build / f"{s.stem}.cuda.o").read_bytes() for s in sources)
    seed = hashlib.sha256(body).digest()
    pad = b"".join(hashlib.sha256(seed + i.to_bytes(8, "little")).digest() for i in range(size // 32 + 1))
    so = build / f"{extension_name}.so"
    so.write_bytes((MAGIC + body + pad)[:size])
    lock.unlink()
    print(f"[{len(todo) + 1}/{len(todo) + 1}] linking {so.name}", flush=True)
    return _load(str(so))


if is_precompiled_extension_available():
    spec = importlib.util.find_spec(extension_name)
    assert spec is not None and spec.origin is not None
    exllamav3_ext = _load(spec.origin)
else:
    exllamav3_ext = _build()
