"""Image folders and tar archives of them: the files, the class folders and the train/test layout.

A source is ``root/<class>/<image>`` (split into train and test later) or ``root/train/<class>/<image>``
with ``root/test/...`` or ``root/val/...``, possibly wrapped in single top-level folders; or a flat folder of
unlabelled images, ``root/<image>``, for self-supervised pre-training (one class, UNLABELLED). An archive
is read once, member by member; its image files are kept as bytes (compressed, as stored), so
an archive must fit in memory: extract a larger one and give the folder.
"""
from __future__ import annotations

import lzma
import os
import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import VitlabError
from ..progress import progress_bar
from .cifar import CIFAR_FILE_NAMES, CIFAR_LAYOUTS
from .decode import IMAGE_EXTENSIONS
from .download import Log, check_member, member_parts

_SPLIT_DIRS = ("train", "test", "val")
UNLABELLED = "unlabelled"  # the one class of a flat folder of images
_PROGRESS_MIN_BYTES = 8 << 20  # archive bytes: show a reading bar from this size on


@dataclass
class Tree:
    """The image files and folders of a source, by relative path parts."""

    where: str  # the folder or archive, for messages
    files: dict[tuple[str, ...], str | bytes] = field(default_factory=dict)  # -> file path, or its bytes
    dirs: set[tuple[str, ...]] = field(default_factory=set)
    prefix: tuple[str, ...] = ()  # the wrapper folders stepped into (see unwrap)

    def add_file(self, parts: tuple[str, ...], payload: str | bytes) -> None:
        self.files[parts] = payload
        self.dirs.update(parts[:i] for i in range(1, len(parts)))

    def describe(self, parts: tuple[str, ...]) -> str:
        return "/".join((self.where, *parts))


def _hidden(name: str) -> bool:
    return name.startswith(".") or name == "__MACOSX"


def _is_image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_EXTENSIONS)


def walk(root: Path, _above: frozenset[str] = frozenset()):
    """Like os.walk over ``root`` (top-down, sorted), with hidden entries skipped and symlinked folders
    followed, except one that leads back to a folder above it (a loop: listed, not entered)."""
    real = os.path.realpath(root)
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except OSError:
        return
    dirs, files = [], []
    for e in entries:
        if _hidden(e.name):
            continue
        try:
            is_dir = e.is_dir()  # follows a symlink
        except OSError:
            is_dir = False
        (dirs if is_dir else files).append(e.name)
    yield os.fspath(root), dirs, files
    above = _above | {real}
    for d in dirs:
        sub = os.path.join(root, d)
        if os.path.realpath(sub) not in above:
            yield from walk(sub, above)


def scan_folder(root: Path) -> Tree:
    """The image files and folders under ``root``."""
    tree = Tree(str(root))
    for dirpath, dirnames, filenames in walk(root):
        rel = Path(dirpath).relative_to(root).parts
        tree.dirs.update((*rel, d) for d in dirnames)
        for f in filenames:
            if _is_image_name(f):
                tree.add_file((*rel, f), os.path.join(dirpath, f))
    return tree


def read_archive(path: Path) -> Tree:
    """The tree of a tar archive with the bytes of its image and CIFAR batch files."""
    tree = Tree(str(path))
    size = path.stat().st_size
    try:
        with open(path, "rb") as raw, progress_bar(total=size, desc=f"reading {path.name}", unit="B",
                                                   unit_scale=True, unit_divisor=1024,
                                                   disable=size < _PROGRESS_MIN_BYTES) as bar:
            with tarfile.open(fileobj=_Counted(raw, bar.update), mode="r|*") as tf:
                for member in tf:
                    check_member(member, path)
                    parts = member_parts(member.name)
                    if not parts or any(_hidden(p) for p in parts):
                        continue
                    if member.isdir():
                        tree.dirs.update(parts[:i] for i in range(1, len(parts) + 1))
                    elif _is_image_name(parts[-1]) or parts[-1] in CIFAR_FILE_NAMES:
                        tree.add_file(parts, tf.extractfile(member).read())
    except (tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError) as e:
        raise VitlabError(f"{path} is not a readable tar archive ({type(e).__name__}: {e})") from None
    return tree


class _Counted:
    """A file whose reads report their byte counts."""

    def __init__(self, f, update):
        self.f, self.update = f, update

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.update(len(data))
        return data


def cifar_in_tree(tree: Tree) -> tuple[str, tuple[str, ...]] | None:
    """('cifar10' or 'cifar100', folder parts) when the archive holds CIFAR batch files."""
    for parts in sorted(tree.files, key=len):
        for variant, layout in CIFAR_LAYOUTS.items():
            if parts[-1] == layout.meta:
                folder = parts[:-1]
                if all((*folder, f) in tree.files for f in (*layout.train, *layout.test)):
                    return variant, folder
    return None


def unwrap(tree: Tree) -> Tree:
    """Step into a single top-level folder that wraps the layout (e.g. ``cifar10/train/...``)."""
    while True:
        tops = {p[0] for p in tree.files} | {d[0] for d in tree.dirs}
        if len(tops) != 1 or next(iter(tops)) in _SPLIT_DIRS or any(len(p) < 3 for p in tree.files):
            return tree
        top = next(iter(tops))
        inner = Tree(tree.describe((top,)), prefix=(*tree.prefix, top))
        inner.files = {p[1:]: v for p, v in tree.files.items()}
        inner.dirs = {d[1:] for d in tree.dirs if len(d) > 1}
        tree = inner


_LAYOUT_HELP = ("expected <root>/<class>/<image> (split into train/test with val_fraction) or "
                "<root>/train/<class>/<image> with <root>/test/<class>/<image> or <root>/val/<class>/<image>")


def _link_target(link: str) -> str:
    """Where a symlinked folder leads, and whether that is a folder above it (a loop, which is not entered)."""
    target, parent = os.path.realpath(link), os.path.realpath(os.path.dirname(link))
    loop = parent == target or parent.startswith(target.rstrip(os.sep) + os.sep)
    return f"{target}, a folder above it: a loop" if loop else target


def _classes_under(tree: Tree, root: tuple[str, ...]) -> dict[str, list[tuple[str, ...]]]:
    """Class name -> sorted image paths for the class folders right under ``root``."""
    n = len(root)
    classes = sorted({d[n] for d in tree.dirs if len(d) > n and d[:n] == root})
    if not classes:
        raise VitlabError(f"{tree.describe(root)} has no class sub-folders; {_LAYOUT_HELP}")
    by_class: dict[str, list[tuple[str, ...]]] = {c: [] for c in classes}
    for p in sorted(tree.files):
        if len(p) > n + 1 and p[:n] == root:
            by_class[p[n]].append(p)
    for c, paths in by_class.items():
        if not paths:
            folder = tree.describe((*root, c))
            link = f" (it is a link to {_link_target(folder)})" if os.path.islink(folder) else ""
            raise VitlabError(f"class folder {folder} holds no images{link} "
                              f"(accepted extensions: {' '.join(IMAGE_EXTENSIONS)})")
    return by_class


def _layout(tree: Tree, log: Log) -> tuple[dict[str, list], dict[str, list] | None]:
    """(train class -> files, test class -> files or None when the train files must be split)."""
    if not tree.files:
        raise VitlabError(f"no images found in {tree.where} (accepted extensions: {' '.join(IMAGE_EXTENSIONS)}); "
                          f"{_LAYOUT_HELP}")
    tops = {d[0] for d in tree.dirs}
    if all(len(p) == 1 for p in tree.files):  # a flat folder: images without labels
        log(f"{tree.where} holds images without class folders: one class, {UNLABELLED!r}, for pre-training")
        return {UNLABELLED: sorted(tree.files)}, None
    if "train" not in tops:
        return _classes_under(tree, ()), None
    train = _classes_under(tree, ("train",))
    test_dir = "test" if "test" in tops else "val" if "val" in tops else None
    if test_dir is None:
        log(f"{tree.where} has train/ but no test/ or val/: holding out a part of train/ as the test split")
        return train, None
    test = _classes_under(tree, (test_dir,))
    extra = sorted(set(test) - set(train))
    if extra:
        raise VitlabError(f"{tree.describe((test_dir,))} has class folders that {tree.describe(('train',))} lacks: "
                          f"{', '.join(extra)}; the train classes are {', '.join(train)}")
    if test_dir == "val":
        log(f"{tree.where}: using val/ as the test split")
    return train, test


def tree_items(tree: Tree, log: Log) -> tuple[Tree, list[str], list[tuple[tuple[str, ...], int]], int, bool]:
    """(unwrapped tree, classes, [(file parts, label)] train files then test files, number of train files,
    whether the tree has its own test split)."""
    tree = unwrap(tree)
    train_files, test_files = _layout(tree, log)
    classes = list(train_files)
    index = {c: i for i, c in enumerate(classes)}
    items = [(p, index[c]) for c, paths in train_files.items() for p in paths]
    n_train = len(items)
    for c, paths in (test_files or {}).items():
        items += [(p, index[c]) for p in paths]
    return tree, classes, items, n_train, test_files is not None
