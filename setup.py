"""The CUDA sources (the top-level native/) ship in the wheel as package data, `axkern/_native/`.

The rest of the configuration is in pyproject.toml. The sources are copied into the build by
`build_py` rather than mapped as a package from outside src/: a package mapped from another
folder makes an editable install use setuptools' import-hook finder, which type checkers cannot
follow; with src/ alone the editable install is a static path file. An editable install copies
nothing: the loader (`axkern.core.native.source_dir`) finds native/ beside src/ in a checkout.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

NATIVE = Path(__file__).resolve().parent / "native"
SUFFIXES = (".cu", ".cuh")


class BuildPyWithNative(build_py):
    """build_py, then the CUDA sources copied into the built package as `axkern/_native/`."""

    def native_sources(self) -> list[Path]:
        return sorted(p for p in NATIVE.rglob("*") if p.suffix in SUFFIXES and p.is_file())

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib, "axkern", "_native")
        for source in self.native_sources():
            out = target / source.relative_to(NATIVE)
            self.mkpath(str(out.parent))
            self.copy_file(str(source), str(out))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        target = Path(self.build_lib, "axkern", "_native")
        return outputs + [str(target / p.relative_to(NATIVE)) for p in self.native_sources()]


setup(cmdclass={"build_py": BuildPyWithNative})
