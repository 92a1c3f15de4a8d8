"""A run's identity, and the checks that keep a run folder's files telling one story.

``run.json`` is written once, when a run starts: a run id, the identity of the data it trains on and how that data
is split (``data.sources.data_identity``), the files of the models it is built from (its teacher, its --init model:
``checkpoint.files_sha256``) and the thread count. Every checkpoint carries the run id and the recipe as run (less
what ``--resume`` may change), so that on ``--resume`` a config.yaml edited by hand, another run's checkpoint copied
in, data that changed since, or a teacher or --init model whose files changed since are each refused in one line;
``eval``, ``inspect`` and ``probe`` of a run refuse its data set when its split is no longer the one the run trained
on.
"""
from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from ..atomic import atomic_write_json, read_json_object
from ..checkpoint import files_sha256
from ..errors import VitlabError
from .format import (
    CHECKPOINT,
    CONFIG_YAML,
    METRICS,
    RUN_JSON,
    EpochRow,
    load_checkpoint,
    write_config_values,
    write_metrics,
)

# what `--resume` may change: how long the run goes on, how it reports, where it computes; the recipe's other
# values made the run what it is
ON_RESUME = ("epochs", "time_budget", "eval_every", "log", "threads", "device", "cache_dir", "download", "workers",
             "checkpoint_every")


def recipe_record(config: dict[str, Any]) -> dict[str, Any]:
    """The recipe as a checkpoint records it: config.yaml's values as YAML reads them back, less ON_RESUME and the
    folder's own place (a run folder may be moved)."""
    plain = yaml.safe_load(yaml.safe_dump(config, sort_keys=True))
    return {k: v for k, v in plain.items() if k not in (*ON_RESUME, "out")}


def new_identity(data: dict[str, Any] | None, built_from: dict[str, Any] | None = None) -> dict[str, Any]:
    """run.json's values for a run that starts now (``built_from``: ``models_built_from``'s)."""
    return {"run_id": secrets.token_hex(8), "data": data, "threads": torch.get_num_threads(), "cwd": os.getcwd(),
            **({"built_from": built_from} if built_from else {})}


def models_built_from(sources: dict[str, str | None]) -> dict[str, Any]:
    """The files of the models a run starts from or learns from (``sources``: {"teacher": folder, "init": folder},
    None where the run has none): the sha256 of each file vitlab.load reads, by role."""
    return {role: {"source": str(source), "files": files_sha256(source)} for role, source in sources.items() if source}


ROLE = {"teacher": ("teacher", "learn from another teacher"), "init": ("--init model", "go on from another model's "
                                                                         "preprocessing and architecture")}


def check_built_from(out: Path, recorded: dict[str, Any] | None, now: dict[str, Any]) -> None:
    """Refuse (one line) to resume a run whose teacher or --init model is not the files it started with, naming the
    files that changed."""
    for role, was in (recorded or {}).items():
        found = (now.get(role) or {}).get("files") or {}
        changed = sorted(name for name in {*was["files"], *found} if was["files"].get(name) != found.get(name))
        if changed:
            what, would = ROLE.get(role, (role, "go on from other files"))
            files = f"{', '.join(changed)} {'is not the file' if len(changed) == 1 else 'are not the files'}"
            raise VitlabError(f"the {what} of {out} changed since the run started ({was['source']}: {files} it started "
                              f"with); resumed, the run would {would}; accepted: the {what} as the run started with "
                              "it, or a new run (vitlab train --out NEW_FOLDER)")


def write_identity(out: Path, identity: dict[str, Any]) -> None:
    atomic_write_json(Path(out) / RUN_JSON, identity)


def write_run_files(out: Path, config: dict[str, Any], identity: dict[str, Any]) -> None:
    """config.yaml and run.json, once a run is set up (a set-up that fails leaves no recipe asking for a resume)."""
    write_config_values(out, config)
    write_identity(out, identity)


def read_identity(folder: str | os.PathLike) -> dict[str, Any] | None:
    """run.json of a run folder (None: a folder without one, from a vitlab that did not write it, or not a run)."""
    path = Path(folder) / RUN_JSON
    return read_json_object(path) if path.is_file() else None


def checkpoint_marks(identity: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """What every checkpoint of the run carries besides its state: the run's id and the recipe as run."""
    return {"run_id": identity["run_id"], "recipe": recipe_record(config)}


def _changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in {*old, *new} if old.get(k) != new.get(k))
    shown = ", ".join(f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys[:3])
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def own_checkpoint(out: Path, config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint of the run in ``out`` (None: none yet), once it is found to be this run's, trained with the
    recipe ``config`` (config.yaml's values as read back for the resume); refused in one line otherwise."""
    ckpt = load_checkpoint(out)
    if ckpt is not None:
        check_checkpoint(out, ckpt, read_identity(out), config)
        rows_written(out, ckpt.get("history") or [])
    return ckpt


def check_checkpoint(out: Path, ckpt: dict[str, Any], identity: dict[str, Any] | None, config: dict[str, Any]) -> None:
    """Refuse (one line) a checkpoint that is not this run's, or a config.yaml that is not the recipe it ran."""
    ckpt_path, run_json = Path(out) / CHECKPOINT, Path(out) / RUN_JSON
    if "run_id" not in ckpt and identity is None:
        return  # a run from a vitlab that recorded no identity: nothing to hold it to
    if identity is None:
        raise VitlabError(f"{out} has a {CHECKPOINT} but no {RUN_JSON} (it was deleted, or the checkpoint was "
                          "copied in from another run): the folder's files disagree; accepted: a run folder as "
                          "vitlab train wrote it")
    if ckpt.get("run_id") != identity.get("run_id"):
        theirs, mine = (ckpt.get("recipe") or {}).get("model"), config.get("model")
        weights = f" and holds the weights of {theirs}, not of {mine}" if theirs and mine and theirs != mine else ""
        raise VitlabError(f"{ckpt_path} belongs to another run (run {ckpt.get('run_id') or 'unknown'}){weights}, not "
                          f"to the run {identity.get('run_id')} of {run_json}: it was copied in; accepted: a "
                          "checkpoint of this run")
    recorded, now = ckpt.get("recipe") or {}, recipe_record(config)
    if now.get("model") is None:  # a recipe given without a model name (--init names it): the one the run wrote
        now["model"] = recorded.get("model")
    if recorded != now:
        raise VitlabError(f"{Path(out) / CONFIG_YAML} is not the recipe {ckpt_path} was trained with "
                          f"({_changed(recorded, now)}): it was edited since; accepted: the recipe as the run wrote "
                          f"it (only {', '.join('--' + k.replace('_', '-') for k in ON_RESUME)} may change on "
                          "--resume)")


def data_change(recorded: dict[str, Any] | None, now: dict[str, Any] | None) -> str | None:
    """What changed between the data a run recorded and the data found now (None: the same split)."""
    if not recorded or not now or recorded.get("fingerprint") == now.get("fingerprint"):
        return None
    if recorded.get("classes") != now.get("classes"):
        return f"its classes are now {len(now['classes'])} ({', '.join(map(str, now['classes'][:5]))}), " \
               f"the run's were {len(recorded['classes'])}"
    counts = [(k, recorded.get(k), now.get(k)) for k in ("num_train", "num_test")]
    if any(a != b for _, a, b in counts):
        return (f"it now splits into {now['num_train']} train / {now['num_test']} test images, the run's split was "
                f"{recorded['num_train']} / {recorded['num_test']}")
    if recorded.get("labels_sha256") != now.get("labels_sha256"):
        return "its images are now split differently"
    if "contents_sha256" in recorded and recorded["contents_sha256"] != now.get("contents_sha256"):
        return "a shard was rewritten since (its size or modification time is not the one the run read)"
    return None  # the files moved or were touched: the same listing, split the same way


def check_data(folder: str | os.PathLike, now: dict[str, Any] | None, what: str, own: bool) -> None:
    """Refuse (one line) to ``what`` (e.g. "evaluate") a run on its data set when its split is not the one the run
    trained on: the data set is the run's own (``own``: none was named) or the same source."""
    identity = read_identity(folder) if Path(folder).is_dir() else None
    recorded = (identity or {}).get("data") or {}
    if not own and recorded.get("source") != (now or {}).get("source"):
        return  # another data set: its split is its own
    said = data_change(recorded, now)
    if said:
        raise VitlabError(f"the data of {folder} changed since the run trained on it ({(now or {}).get('source')}: "
                          f"{said}), so its test split would hold images the run trained on; cannot {what} on it; "
                          "accepted: the data as the run saw it, or another data set (--data)")


def resumed_threads(identity: dict[str, Any]) -> str:
    """A resumed run without --threads goes on with the thread count it trained with (run.json), so that it ends as a
    run never stopped; OMP_NUM_THREADS, where set, decides instead. Returns the line that says so."""
    was = identity.get("threads")
    if os.environ.get("OMP_NUM_THREADS") or not was:
        return f"threads: {torch.get_num_threads()} ({'OMP_NUM_THREADS' if was else 'the run recorded none'})"
    torch.set_num_threads(was)
    return f"threads: {was}, as the run trained with ({RUN_JSON})"


def check_threads(identity: dict[str, Any], resumed: bool, log: Callable[[str], None]) -> None:
    """Record, for a new run, the thread count it trains with; say, on a resume with another count than the run's,
    that its numbers will differ from a run never stopped (sums are taken in another order)."""
    was, now = identity.get("threads"), torch.get_num_threads()
    if not resumed:
        identity["threads"] = now
    elif was is not None and was != now:
        log(f"warning: the run trained with {was} threads and resumes with {now}: floating-point sums are taken in "
            f"another order, so its numbers will differ from those of a run never stopped (--threads {was} "
            "reproduces them)")


def rows_written(out: Path, rows: Sequence[dict[str, Any]]) -> int:
    """How many of the checkpoint's ``rows`` metrics.jsonl holds (it may lack the latest: the run was killed between
    the checkpoint and the metrics write); a file holding rows the checkpoint does not have is refused in one line."""
    path = Path(out) / METRICS
    lines = path.read_text().splitlines() if path.is_file() else []
    saved = [json.dumps(EpochRow.from_dict(r).to_dict()) for r in rows]
    try:
        found = [json.dumps(EpochRow.from_dict(json.loads(line)).to_dict()) for line in lines]
    except (json.JSONDecodeError, ValueError, TypeError):
        found = None
    if found is None or found != saved[:len(found)]:
        raise VitlabError(f"{path} disagrees with the history in {Path(out) / CHECKPOINT} ({len(lines)} lines, "
                          f"the checkpoint has {len(rows)} epochs): it was edited or comes from another run; "
                          "accepted: a run folder as vitlab train wrote it")
    return len(found)


def restore_history(out: Path, rows: Sequence[dict[str, Any]], log: Callable[[str], None]) -> None:
    """Make metrics.jsonl hold every row of the checkpoint, and say so when it lacked some."""
    found = rows_written(out, rows)
    if found < len(rows):
        write_metrics(out, [EpochRow.from_dict(r) for r in rows])
        log(f"{METRICS} had {found} of the {len(rows)} epochs in the checkpoint (the run was stopped between "
            "the two writes): completed from the checkpoint")


def run_identity(out: Path, ckpt: dict[str, Any] | None, data: dict[str, Any] | None,
                 log: Callable[[str], None], sources: dict[str, str | None] | None = None) -> dict[str, Any]:
    """The identity a run goes on under: a new one when it starts (or starts over: no checkpoint yet); on a resume
    from ``ckpt`` (``own_checkpoint``), run.json's, once the data is found to be split as the run's was and the
    models in ``sources`` (``models_built_from``) to be the files it started with (refused in one line when not), the
    thread count compared and metrics.jsonl completed from the checkpoint."""
    built_from = models_built_from(sources or {})
    if ckpt is None:
        return new_identity(data, built_from)
    identity = read_identity(out)
    check_built_from(out, (identity or {}).get("built_from"), built_from)
    said = data_change((identity or {}).get("data"), data)
    if said:
        raise VitlabError(f"the data of {out} changed since the run started ({(data or {}).get('source')}: {said}); "
                          "resumed on it, the run would go on with another split; accepted: the data as the run "
                          "started on it, or a new run (vitlab train --out NEW_FOLDER)")
    restore_history(out, ckpt.get("history") or [], log)
    return identity or new_identity(data)
