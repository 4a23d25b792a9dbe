"""The checkpoints under one root: build one in a ``.partial`` directory, commit it by
writing its manifest last and renaming the directory, prune old ones, find the latest.

A directory named ``step-<step>`` exists only once all its files and its manifest are
durable. A crash at any point leaves earlier checkpoints as they were and, at worst, a
``.partial`` directory that is never read and is removed by the next commit. Directories
that are being deleted or replaced are first renamed out of the ``step-<step>`` namespace
for the same reason. One writer per root at a time (the launcher claims the root for its
run's life, :mod:`cargohold.cluster.claims`); readers may run concurrently with it.

Runs may follow one another in a root: a store given ``owners`` (the run ids of the run
writing, and of the run it resumed) prunes only their checkpoints, and leaves every other
run's (a complete checkpoint of the same step is still replaced by a commit).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from cargohold.services.checkpoint.errors import os_error
from cargohold.services.checkpoint.files import check_regular, open_regular
from cargohold.services.checkpoint.manifest import MANIFEST_NAME, Manifest, gaps, is_int
from cargohold.services.core.durable import fsync_directory, replace_durably
from cargohold.services.core.errors import CheckpointError

logger = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"step-(\d{10,})")
_PARTIAL_DIR = re.compile(r"step-(\d{10,})\.partial")
_TRASH_SUFFIXES = (".deleting", ".replaced")
"""Suffixes of directories on their way out; never read, removed by the next commit."""


class CheckpointDir:
    """The checkpoints under one root: build, commit, prune, find.

    ``keep_last`` complete checkpoints are kept; the one just committed always is.
    ``owners``: run ids whose checkpoints this store may prune (by their
    manifests' ``run_id``); None: every checkpoint under the root. The writer adds each
    run id it commits under (:meth:`own`).
    """

    def __init__(self, root: Path, *, keep_last: int = 3, owners: set[str] | None = None) -> None:
        if not is_int(keep_last) or keep_last < 1:
            raise ValueError(f"keep_last must be an integer >= 1, got {keep_last!r}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.owners = owners

    def own(self, run_id: str) -> None:
        """Count ``run_id``'s checkpoints as this store's writer's (a no-op without owners)."""
        if self.owners is not None:
            self.owners.add(run_id)

    def owns(self, path: Path) -> bool:
        """Whether this store may remove the complete checkpoint at ``path``: no owners
        were given, or its manifest names one of them (an unreadable one is nobody's)."""
        if self.owners is None:
            return True
        try:
            return self.load(path).run_id in self.owners
        except CheckpointError:
            return False

    def final_dir(self, step: int) -> Path:
        return self.root / f"step-{step:010d}"

    def partial_dir(self, step: int) -> Path:
        return self.root / f"step-{step:010d}.partial"

    def begin(self, step: int) -> Path:
        """Create a fresh ``step-<step>.partial`` directory (removing a stale one, e.g.
        from a crashed save) for the payload files of ``step``."""
        if not is_int(step) or step < 0:
            raise CheckpointError(f"step must be an integer >= 0, got {step!r}")
        partial = self.partial_dir(step)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if partial.exists():
                shutil.rmtree(partial)
            partial.mkdir()
        except OSError as error:
            raise os_error("creating checkpoint directory", partial, error) from error
        return partial

    def commit(self, step: int, manifest: Manifest) -> Path:
        """Make the partial checkpoint of ``step`` complete: check its files, write the
        manifest, rename the directory to its final name, then prune.

        On failure the partial directory is removed (it cannot become a checkpoint),
        earlier checkpoints are untouched, and CheckpointError says why. A complete
        checkpoint of the same step is replaced.
        """
        partial, final = self.partial_dir(step), self.final_dir(step)
        replaced: Path | None = None
        try:
            if manifest.step != step:
                raise CheckpointError(f"commit of step {step} got a manifest of step {manifest.step}")
            if not partial.is_dir():
                raise CheckpointError(f"{partial} does not exist; call begin({step}) before commit")
            missing = gaps(manifest.segments, 0, manifest.total)
            if missing:
                raise CheckpointError(
                    f"the manifest of step {step} covers no segment for flat elements {missing[0]} "
                    f"of [0, {manifest.total}); a state server's files are missing from it"
                )
            _check_files(partial, manifest)
            _write_manifest(partial / MANIFEST_NAME, manifest)
            if final.exists():
                replaced = final.with_name(final.name + ".replaced")
                _remove_tree(replaced)
                os.rename(final, replaced)
            os.rename(partial, final)
            fsync_directory(self.root)
        except (OSError, CheckpointError) as error:
            _remove_tree(partial)
            if replaced is not None and replaced.exists() and not final.exists():
                try:  # put the checkpoint being replaced back under its name
                    os.rename(replaced, final)
                except OSError:
                    logger.warning("could not restore %s from %s", final, replaced)
            if isinstance(error, CheckpointError):
                raise
            raise os_error("committing checkpoint", final, error) from error
        if replaced is not None:
            _remove_tree(replaced)
        self._prune(step)
        return final

    def abort(self, step: int) -> None:
        """Remove the partial directory of ``step`` (a save that will not be committed)."""
        try:
            if self.partial_dir(step).exists():
                shutil.rmtree(self.partial_dir(step))
        except OSError as error:
            raise os_error("removing partial checkpoint", self.partial_dir(step), error) from error

    def complete_steps(self) -> list[int]:
        """Steps with a directory of the final name, oldest first (not verified)."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        except OSError as error:
            raise os_error("listing checkpoint root", self.root, error) from error
        return sorted(int(m.group(1)) for m in map(_STEP_DIR.fullmatch, names) if m)

    def latest(self) -> Path | None:
        """The newest checkpoint whose manifest parses and whose files exist with the
        recorded sizes. Checksums are verified when the payload is read, not here."""
        for step in reversed(self.complete_steps()):
            path = self.final_dir(step)
            try:
                self._verify(path, step)
            except CheckpointError as error:
                logger.warning("skipping checkpoint %s: %s", path, error)
                continue
            return path
        return None

    def resolve(self, spec: str) -> Path:
        """``"latest"`` or a path (a checkpoint directory or a root) -> a complete
        checkpoint directory."""
        if spec == "latest":
            found = self.latest()
            if found is None:
                raise CheckpointError(f"no complete checkpoint under {self.root} to resume from")
            return found
        path = Path(spec).expanduser()
        if not path.is_dir():
            raise CheckpointError(f"checkpoint {path} does not exist or is not a directory")
        if _PARTIAL_DIR.fullmatch(path.name):
            raise CheckpointError(f"{path} is an unfinished checkpoint (its save never committed)")
        if (path / MANIFEST_NAME).exists() or _STEP_DIR.fullmatch(path.name):
            match = _STEP_DIR.fullmatch(path.name)
            self._verify(path, int(match.group(1)) if match else None)
            return path
        found = CheckpointDir(path, keep_last=self.keep_last).latest()
        if found is None:
            raise CheckpointError(
                f"{path} is neither a checkpoint directory (no {MANIFEST_NAME}) nor a root "
                "holding a complete checkpoint"
            )
        return found

    def load(self, path: Path) -> Manifest:
        """Parse and validate the manifest of the checkpoint at ``path``."""
        source = Path(path) / MANIFEST_NAME
        try:
            with os.fdopen(open_regular(source), "rb") as handle:
                text = handle.read().decode("utf-8")
        except FileNotFoundError as error:
            raise CheckpointError(f"{source} is missing: not a complete checkpoint") from error
        except (OSError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{source}: cannot be read ({error})") from error
        return Manifest.from_json(text, source=str(source))

    def _verify(self, path: Path, step: int | None) -> Manifest:
        manifest = self.load(path)
        if step is not None and manifest.step != step:
            raise CheckpointError(
                f"{path / MANIFEST_NAME}: it is of step {manifest.step}, its directory of step {step}"
            )
        _check_files(path, manifest)
        return manifest

    def _prune(self, committed: int) -> None:
        """Keep ``committed`` and the newest ``keep_last - 1`` others; drop partials of
        older steps and leftovers of interrupted removals. Failures only warn: the
        checkpoint is committed."""
        others = [s for s in self.complete_steps() if s != committed and self.owns(self.final_dir(s))]
        doomed = [self.final_dir(s) for s in others[: max(0, len(others) - (self.keep_last - 1))]]
        try:
            names = os.listdir(self.root)
        except OSError as error:
            logger.warning("cannot list %s to prune old checkpoints: %s", self.root, error)
            names = []
        for name in sorted(names):
            partial = _PARTIAL_DIR.fullmatch(name)
            if (partial and int(partial.group(1)) < committed) or (
                name.startswith("step-") and name.endswith(_TRASH_SUFFIXES)
            ):
                doomed.append(self.root / name)
        for path in doomed:
            try:
                if _STEP_DIR.fullmatch(path.name):
                    # out of the complete namespace first, so a crash mid-delete leaves no
                    # half-deleted directory under a complete checkpoint's name
                    trash = path.with_name(path.name + ".deleting")
                    _remove_tree(trash)
                    os.rename(path, trash)
                    path = trash
                shutil.rmtree(path)
            except OSError as error:
                logger.warning("could not remove %s while pruning checkpoints: %s", path, error)


def _write_manifest(target: Path, manifest: Manifest) -> None:
    try:
        with replace_durably(target) as temporary:
            Path(temporary).write_text(manifest.to_json(), encoding="utf-8")
    except OSError as error:
        raise os_error("writing checkpoint file", target, error) from error


def _check_files(directory: Path, manifest: Manifest) -> None:
    for record in manifest.files:
        path = directory / record.name
        try:
            size = check_regular(path).st_size
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path} named in the manifest is missing") from None
        except OSError as error:
            raise os_error("checking checkpoint file", path, error) from error
        if size != record.nbytes:
            raise CheckpointError(f"checkpoint file {path} is {size} bytes, the manifest records {record.nbytes}")


def _remove_tree(path: Path) -> None:
    """Remove a directory tree if it exists; best effort (used on paths being discarded)."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.warning("could not remove %s: %s", path, error)
