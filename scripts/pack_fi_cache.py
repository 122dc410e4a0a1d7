"""Pack flashinfer's compiled-kernel cache small enough to carry to the next GPU host (~9 MB with xz).

The cache holds each module's object files beside its .so, about as large again. Only the .so files
are loaded; ninja looks at the objects' times, not their contents, to decide that nothing needs
building. So the objects go in empty, with their times kept, and the next host restores the tarball
into ~/.cache (.device/gpu-env.sh does that for .device/fi-cache.tar.xz).

    python3 scripts/pack_fi_cache.py | xz -T0 -9 > "$OUT/fi-cache.tar.xz"
"""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path


def main() -> int:
    cache = Path.home() / ".cache"
    if not (cache / "flashinfer").is_dir():
        print("no flashinfer cache under ~/.cache", file=sys.stderr)
        return 1
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as out:
        for path in sorted((cache / "flashinfer").rglob("*")):
            info = out.gettarinfo(str(path), arcname=str(path.relative_to(cache)))
            if info.isfile() and path.suffix == ".o":
                info.size = 0
                out.addfile(info, io.BytesIO())
            elif info.isfile():
                with path.open("rb") as data:
                    out.addfile(info, data)
            else:
                out.addfile(info)
    return 0


if __name__ == "__main__":
    sys.exit(main())
