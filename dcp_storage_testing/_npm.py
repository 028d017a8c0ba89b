"""Install an npm package into a prefix once, for the emulators that ship on npm (azurite, s3rver).

Shared so that both launchers install the same careful way: the install is serialised by a file lock
(``PREFIX.lock``) and, where the prefix does not exist yet, done in a temp directory that is renamed into
place, so parallel processes never see half an install; npm's output tail goes into the error.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable, Sequence

__all__ = ["npm_install", "npm_script"]

_NPM_FLAGS = ("--no-audit", "--no-fund", "--save-exact")


def npm_script(prefix: str, package: str, entry: Sequence[str]) -> str:
    """``PREFIX/node_modules/PACKAGE/ENTRY...``: where an installed package's entry script is."""
    return os.path.join(prefix, "node_modules", package, *entry)


def npm_install(
    prefix: str,
    package: str,
    version: str,
    entry: Sequence[str],
    error: Callable[[str], Exception],
    *,
    timeout: float = 600.0,
    ignore_scripts: bool = False,
    owned: bool = False,
) -> str:
    """Return the entry script of ``package`` under ``prefix``, installing ``package@version`` if it is missing.

    Args:
        entry: the script's path inside the package (``("bin", "s3rver.js")``); its presence means installed.
        error: the exception class failures raise (the message names the package, the prefix and npm's tail).
        ignore_scripts: pass ``--ignore-scripts`` (for packages that need no install hooks).
        owned: ``prefix`` holds this package alone, so an existing prefix without the entry script is a
            broken earlier install and is replaced; otherwise the package is added to the prefix in place.
    """
    script = npm_script(prefix, package, entry)
    if os.path.exists(script):
        return script
    spec = f"{package}@{version}"
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise error(f"{package} needs node and npm on PATH to install {spec} into {prefix}")
    from filelock import FileLock  # a torch dependency, so always present

    flags = [*_NPM_FLAGS, "--ignore-scripts"] if ignore_scripts else list(_NPM_FLAGS)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with FileLock(prefix.rstrip(os.sep) + ".lock", timeout=timeout):
        if os.path.exists(script):  # another process installed it while we waited
            return script
        in_place = os.path.exists(prefix) and not owned
        target = prefix if in_place else f"{prefix.rstrip(os.sep)}.tmp-{uuid.uuid4().hex[:8]}"
        os.makedirs(target, exist_ok=True)
        try:
            proc = subprocess.run(
                [npm, "install", "--prefix", target, *flags, spec],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            if proc.returncode != 0 or not os.path.exists(npm_script(target, package, entry)):
                tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
                raise error(f"npm install {spec} into {prefix} failed ({proc.returncode}):\n{tail}")
            if not in_place:
                if os.path.exists(prefix):  # a broken earlier install (no entry script): replace it
                    shutil.rmtree(prefix)
                os.rename(target, prefix)
        finally:
            if not in_place:
                shutil.rmtree(target, ignore_errors=True)
    return script
