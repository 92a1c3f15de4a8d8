"""Hugging Face Hub ids, ``hf-hub:org/name[@revision]``: a repository's model files through huggingface_hub.

Downloads go through huggingface_hub's cache (``HF_HUB_CACHE`` / ``HF_HOME``), so a file is fetched
once; ``HF_HUB_OFFLINE=1`` reads the cache alone; the token comes from where huggingface_hub looks
(``HF_TOKEN``, or the one ``hf auth login`` stored). Only the files vitlab reads are fetched: config.json,
one weights format (safetensors first) and preprocessor_config.json where a repository has one.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import NotFoundError, VitlabError

PREFIX = "hf-hub:"
CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
OPTIONAL_FILES = ("preprocessor_config.json",)
INSTALL_HINT = "pip install 'vitlab[hub]'"


def is_hub_id(path: object) -> bool:
    """True for a string that names a Hub repository (``hf-hub:...``)."""
    return isinstance(path, str) and path.startswith(PREFIX)


def parse(hub_id: str) -> tuple[str, str | None]:
    """``hf-hub:org/name@rev`` -> ("org/name", "rev"); the revision is None when not given."""
    ref = hub_id[len(PREFIX):]
    repo_id, _, revision = ref.partition("@")
    parts = repo_id.split("/")
    if len(parts) > 2 or not all(parts) or (revision == "" and "@" in ref):
        raise VitlabError(f"{hub_id!r} is not a Hub id: expected hf-hub:ORG/NAME or hf-hub:ORG/NAME@REVISION")
    return repo_id, revision or None


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise VitlabError(f"loading a model by Hub id needs huggingface_hub: {INSTALL_HINT}") from None
    return huggingface_hub


def _listing(repo_id: str, revision: str | None, folder: Path | None) -> list[str]:
    """The repository's files: from the Hub when it can be reached, else those in the local snapshot."""
    hub = _hub()
    try:
        return sorted(hub.list_repo_files(repo_id, revision=revision))
    except Exception:  # noqa: BLE001 - offline or unreachable: fall back to what the cache holds
        if folder is None or not folder.is_dir():
            return []
        return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _where(repo_id: str, revision: str | None) -> str:
    return repo_id + (f"@{revision}" if revision else "")


def download(hub_id: str) -> Path:
    """The local folder (a snapshot in huggingface_hub's cache) holding a Hub model's config.json and weights."""
    repo_id, revision = parse(hub_id)
    hub = _hub()
    from huggingface_hub import constants, errors

    where = _where(repo_id, revision)
    offline = bool(getattr(constants, "HF_HUB_OFFLINE", False))

    _MISSING = (errors.EntryNotFoundError, errors.LocalEntryNotFoundError)  # noqa: N806

    def fetch(filename: str) -> Path:
        return Path(hub.hf_hub_download(repo_id, filename, revision=revision))

    try:
        folder = fetch(CONFIG).parent
    except errors.RepositoryNotFoundError:
        raise NotFoundError(f"no Hub repository {repo_id!r} (a private or gated one needs a token: "
                            "HF_TOKEN or `hf auth login`)") from None
    except errors.RevisionNotFoundError:
        raise NotFoundError(f"Hub repository {repo_id} has no revision {revision!r}") from None
    except errors.LocalEntryNotFoundError:
        reason = "HF_HUB_OFFLINE is set" if offline else "the Hub cannot be reached"
        raise NotFoundError(f"{where}: {CONFIG} is not in the Hub cache ({constants.HF_HUB_CACHE}) "
                            f"and {reason}") from None
    except errors.EntryNotFoundError:
        found = _listing(repo_id, revision, None)
        raise NotFoundError(f"{where} has no {CONFIG}, which vitlab needs (with one of {', '.join(WEIGHT_FILES)}); "
                            f"it holds: {', '.join(found) or 'nothing'}") from None
    for name in WEIGHT_FILES:
        try:
            path = fetch(name)
        except _MISSING:  # not in the repository, or (offline) not in the cache
            continue
        if name.endswith(".index.json"):
            for shard in sorted(set(json.loads(path.read_text())["weight_map"].values())):
                fetch(shard)
        break
    else:
        found = _listing(repo_id, revision, folder)
        state = " in the Hub cache (HF_HUB_OFFLINE is set)" if offline else ""
        raise NotFoundError(f"{where} has no weights vitlab reads{state}: it needs {CONFIG} and one of "
                            f"{', '.join(WEIGHT_FILES)}; found: {', '.join(found) or 'nothing'}")
    for name in OPTIONAL_FILES:
        try:
            fetch(name)
        except _MISSING:
            pass
    return folder
