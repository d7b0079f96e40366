"""The shared core of model preparation: the error type, JSON files, the "complete model" test and
the atomic, locked build of a model folder that every source uses.

Every folder is built next to its destination (``<dest>.tmp``) and renamed into place, so an
interrupted run never leaves a half-written model behind. A per-destination lock file makes
concurrent preparations (a prefill and a decode worker starting together) build it only once.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Files copied from a source checkpoint besides the weights. tokenizer.json is the one the engine needs;
# the others carry special tokens and the chat template for transformers' AutoTokenizer.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)



class ModelPrepError(Exception):
    """A model could not be prepared. The message is meant for the user: it says what is wrong and,
    where there is one, what to do instead. Callers print it without a traceback."""



def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON object file, turning every failure into a ModelPrepError naming the file."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelPrepError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelPrepError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelPrepError(f"{path} must hold a JSON object, not {type(data).__name__}")
    return data



def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write `data` as indented, key-sorted JSON (stable bytes, so identical inputs give identical files)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")



def safetensors_files(path: Path) -> list[Path] | None:
    """The weight files of a checkpoint folder, or None when it has no (complete) safetensors set.

    A sharded checkpoint counts only when every shard its index names is present, so a download that
    died between shards is not mistaken for a model.
    """
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        files = [path / name for name in names]
        return files if files and all(f.is_file() for f in files) else None
    files = sorted(path.glob("*.safetensors"))
    return files or None



def is_complete_model(path: str | Path) -> bool:
    """Whether `path` holds a servable checkpoint: config.json, safetensors weights and tokenizer.json."""
    path = Path(path)
    return (
        path.is_dir()
        and (path / "config.json").is_file()
        and (path / "tokenizer.json").is_file()
        and safetensors_files(path) is not None
    )



@contextlib.contextmanager
def dest_lock(dest: Path) -> Iterator[None]:
    """Hold an exclusive lock for `dest` (a hidden `.<name>.lock` file next to it).

    Prefill and decode workers are often started together and both ask for the same model; the lock
    makes the second one wait and then find the finished folder instead of building its own copy in the
    same `.tmp` folder.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    lock_path = dest.parent / f".{dest.name}.lock"
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no locking, atomic renames still protect dest
        yield
        return
    with open(lock_path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)



def remove_path(path: Path) -> None:
    """Remove a file, symlink or folder tree (no error when it does not exist)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)



def _current_umask() -> int:
    """The process umask, read from /proc where possible: os.umask() can only be read by setting it,
    which briefly changes it for every thread of the process."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask



def _fix_permissions(folder: Path) -> None:
    """Give every file the umask's default mode: safetensors writes weights as 0600, which a worker
    running as another user (containers, shared model volumes) could not read."""
    umask = _current_umask()
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)



def atomic_build(dest: Path, builder: Callable[[Path], None], *, force: bool, what: str) -> Path:
    """Run `builder(tmp)` to fill `<dest>.tmp`, check the result is complete and rename it to `dest`.

    Skips everything when `dest` already holds a complete model and `force` is false. On any failure
    the temporary folder is removed and `dest` is left as it was.
    """
    dest = Path(dest)
    with dest_lock(dest):
        # Checked under the lock: a concurrent run may have just finished the same model.
        if not force and is_complete_model(dest):
            logger.info("%s already prepared in %s", what, dest)
            return dest
        tmp = dest.with_name(dest.name + ".tmp")
        try:
            remove_path(tmp)  # left over by an interrupted run
            tmp.mkdir(parents=True)
            builder(tmp)
            _fix_permissions(tmp)
            if not is_complete_model(tmp):
                raise ModelPrepError(
                    f"preparing {what} produced an incomplete folder "
                    "(config.json, *.safetensors and tokenizer.json are all required)"
                )
            # os.replace cannot replace a non-empty folder: move the old one aside first, then drop it.
            old = dest.with_name(dest.name + ".old")
            if dest.exists() or dest.is_symlink():
                remove_path(old)
                os.replace(dest, old)
            os.replace(tmp, dest)
            remove_path(old)
        except ModelPrepError:
            remove_path(tmp)
            raise
        except OSError as exc:
            remove_path(tmp)
            raise ModelPrepError(f"cannot write {what} to {dest}: {exc}") from None
        except BaseException:
            remove_path(tmp)
            raise
    return dest
