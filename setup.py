"""Packaging beyond pyproject.toml: ship ``hora-as-horovod.pth`` at the top of site-packages,
so that ``HORA_AS_HOROVOD=1`` turns on Horovod's module names in any Python process (see
``hora.as_horovod``). The file does nothing unless that variable is set."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "hora-as-horovod.pth"


class BuildPyWithPth(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(os.path.join("src", PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": BuildPyWithPth})
