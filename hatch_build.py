"""Install-time build of pd-transfer's native copy loop (hatchling build hook).

Compiles ``pd_transfer/transport/native/copy_runs.c`` with the system C
compiler (see ``pd_transfer/transport/native/build.py``): into the source tree
for an editable install, into the wheel otherwise. Without a compiler the
install still succeeds, with a warning; copies then run through numpy, slower.
"""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

from hatchling.builders.hooks.plugin.interface import BuildHookInterface
from packaging.tags import sys_tags


class NativeCopyHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel":
            return
        path = Path(self.root) / "pd_transfer" / "transport" / "native" / "build.py"
        spec = importlib.util.spec_from_file_location("pd_transfer_native_build", path)
        native = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(native)
        out_dir = native.HERE if version == "editable" else Path(tempfile.mkdtemp(prefix="pdt-native-"))
        try:
            library = native.build(out_dir, quiet=True)
        except RuntimeError as err:
            self.app.display_warning(
                f"pd-transfer: the native copy loop was not built, copies "
                f"will run through numpy (about half as fast): {err}"
            )
            return
        if version != "editable":
            build_data["force_include"][str(library)] = f"pd_transfer/transport/native/{native.LIBRARY_NAME}"
            # loaded with ctypes, not imported: any Python 3, this platform only
            build_data["pure_python"] = False
            build_data["tag"] = f"py3-none-{next(iter(sys_tags())).platform}"
