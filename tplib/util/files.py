"""Atomic result files: a reader never sees half of one.

Every file tplib writes (CSV tables, figures, profiles, run manifests, results of a
torchrun job) goes through :func:`atomic_write`: the content is written to a temporary
file in the destination's folder and renamed into place only when complete, so an
interrupted run leaves either the old file or the new one, never a truncated one (a run
killed mid-write leaves the temporary file, named ``.<stem>-<random><suffix>``, behind).
Files are created as any new file is, with the permissions the umask allows.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure

__all__ = ["atomic_write", "save_figure", "write_csv", "write_json", "write_text"]


def atomic_write(path: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temporary file beside ``path``, flush it to disk, then
    rename it into place. On any error the temporary file is removed and ``path`` is
    left as it was."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temporary(path)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _new_temporary(path: Path) -> Path:
    """A new empty file beside ``path``, hidden, with its suffix (writers such as savefig
    pick the format by it). Not ``tempfile.mkstemp``: its files are readable by their
    owner alone (0600), and so every result would be."""
    for _ in range(100):
        tmp = path.with_name(f".{path.stem}-{secrets.token_hex(4)}{path.suffix}")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {path}")


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    def write(tmp: Path) -> None:
        tmp.write_text(text, encoding="utf-8")

    return atomic_write(path, write)


def write_json(path: str | os.PathLike[str], data: Any, indent: int | None = 1) -> Path:
    return write_text(path, json.dumps(data, indent=indent) + "\n")


def write_csv(df: pd.DataFrame, path: str | os.PathLike[str]) -> Path:
    return atomic_write(path, lambda tmp: df.to_csv(tmp, index=False))


def save_figure(fig: Figure, path: str | os.PathLike[str], dpi: int = 150) -> Path:
    return atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, bbox_inches="tight"))
