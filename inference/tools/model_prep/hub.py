"""Source ``hub``: a Hugging Face hub repository, downloaded into the HF cache (only when the hub is
reachable, else from that cache) and then prepared like a local folder."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from inference.tools.model_prep.core import TOKENIZER_FILES, ModelPrepError, is_complete_model
from inference.tools.model_prep.local import prepare_from_local

logger = logging.getLogger(__name__)

# Hub download filters: only what the engine reads (never optimizer states, ONNX/GGUF exports, ...).
_HUB_COMMON_PATTERNS: list[str] = ["config.json", "generation_config.json", *TOKENIZER_FILES]

_HUB_SAFETENSORS_PATTERNS: list[str] = ["*.safetensors", "model.safetensors.index.json"]

_HUB_BIN_PATTERNS: list[str] = ["pytorch_model*.bin", "pytorch_model.bin.index.json"]

# Seconds to wait for the hub before giving up. huggingface_hub's own repo_info call has no timeout at
# all (it would hang forever behind a firewall that drops packets), so we pass ours explicitly.
HUB_TIMEOUT_S = float(os.environ.get("MODEL_PREP_HUB_TIMEOUT", "10"))



def _hub_offline() -> bool:
    """HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE, read now: huggingface_hub reads them once at import, so a
    value set later (tests, a caller's os.environ) would otherwise be ignored."""
    from huggingface_hub import constants

    values = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(v and v.strip().lower() in ("1", "true", "yes", "on") for v in values)



def _hub_unreachable(repo_id: str, reason: str) -> ModelPrepError:
    """The error for "no network / no hub", with the offline alternatives."""
    return ModelPrepError(
        f"cannot reach the Hugging Face hub to download {repo_id} ({reason}); "
        "use --source smollm2|tiny|local instead (smollm2 is bundled and needs no network), "
        "or pass a local checkpoint folder as --model-name"
    )



@dataclass(frozen=True)
class _HubPlan:
    """What to download: the revision (a commit hash once the hub answered), the file patterns, and why
    the hub is out of reach (None when it answered; otherwise only the local cache is read)."""

    revision: str | None
    patterns: list[str]
    unreachable: str | None


def _plan_download(repo_id: str, revision: str | None) -> _HubPlan:
    """Ask the hub once (bounded by HUB_TIMEOUT_S) which revision and weight format `repo_id` has.

    Errors that no cache can fix (invalid id, gated, unknown repo or revision, no usable weights) raise
    a ModelPrepError; an unreachable hub yields a cache-only plan.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    safetensors_patterns = [*_HUB_COMMON_PATTERNS, *_HUB_SAFETENSORS_PATTERNS]
    if _hub_offline():
        return _HubPlan(revision, safetensors_patterns, "HF_HUB_OFFLINE is set")
    try:
        info = HfApi().model_info(repo_id, revision=revision, timeout=HUB_TIMEOUT_S)
    except HFValidationError as exc:
        raise ModelPrepError(f"{repo_id!r} is neither a known model name, a local folder nor a valid "
                             f"hub repo id ({exc})") from None
    except GatedRepoError:
        raise ModelPrepError(f"{repo_id} is gated on the hub: accept its licence and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelPrepError(
            f"{repo_id} was not found on the Hugging Face hub (or it is private: set HF_TOKEN); "
            "known offline names: smollm2, tiny, or a local folder"
        ) from None
    except RevisionNotFoundError:
        raise ModelPrepError(f"revision {revision!r} of {repo_id} does not exist on the hub") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        return _HubPlan(revision, safetensors_patterns, f"the hub answered HTTP {status}")
    except Exception as exc:  # DNS failure, refused connection, timeout: the hub is out of reach
        return _HubPlan(revision, safetensors_patterns, f"{type(exc).__name__}: {exc}")
    resolved_revision = info.sha or revision  # a commit hash: snapshot_download skips its own lookup
    siblings = [s.rfilename for s in (info.siblings or [])]
    if any(name.endswith(".safetensors") for name in siblings):
        return _HubPlan(resolved_revision, safetensors_patterns, None)
    if not any(name.startswith("pytorch_model") and name.endswith(".bin") for name in siblings):
        raise ModelPrepError(
            f"{repo_id} has no safetensors or pytorch_model*.bin weights on the hub "
            "(GGUF/ONNX-only repos are not supported)"
        )
    return _HubPlan(resolved_revision, [*_HUB_COMMON_PATTERNS, *_HUB_BIN_PATTERNS], None)


def prepare_from_hub(repo_id: str, dest: Path, cache_dir: Path, *, force: bool = False,
                     revision: str | None = None) -> Path:
    """Download `repo_id` (config, safetensors or .bin weights, tokenizer) into the HF cache at
    `cache_dir` and prepare it into `dest` like a local folder.

    Never hangs: the first hub call has a HUB_TIMEOUT_S timeout, and every connection problem becomes a
    ModelPrepError naming the offline alternatives. With HF_HUB_OFFLINE=1 only the cache is used.
    """
    dest = Path(dest)
    if not force and is_complete_model(dest):
        return dest  # no network needed for a model prepared earlier
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ModelPrepError("huggingface_hub is not installed; use --source smollm2|tiny|local") from None

    plan = _plan_download(repo_id, revision)
    try:
        snapshot = snapshot_download(
            repo_id,
            revision=plan.revision,
            cache_dir=str(cache_dir),
            allow_patterns=plan.patterns,
            etag_timeout=HUB_TIMEOUT_S,
            # Unreachable hub: look in the cache only, instead of retrying the network per file.
            local_files_only=plan.unreachable is not None,
        )
    except LocalEntryNotFoundError:
        reason = plan.unreachable or "connection failed, and it is not in the cache"
        raise _hub_unreachable(repo_id, reason) from None
    except Exception as exc:  # a download dying midway (network drop, disk full, ...)
        raise ModelPrepError(f"downloading {repo_id} from the hub failed: {type(exc).__name__}: {exc}") from None
    if plan.unreachable:
        logger.warning("hub unreachable (%s); using the cached snapshot of %s", plan.unreachable, repo_id)
    return prepare_from_local(Path(str(snapshot)), dest, force=True)
