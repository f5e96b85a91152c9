"""Metadata lives in setup.cfg; this file adds the schemas' package and the man pages."""

import glob

from setuptools import setup
from setuptools.dist import Distribution


class WithSchemas(Distribution):
    """setup.cfg's packages (find:) plus localrt._schemas.

    package_dir maps localrt._schemas to the top-level schemas/ folder, which has no
    __init__.py and is not under localrt/, so find: cannot see it; localrt.schemas
    loads the files from it with importlib.resources. It is added once setup.cfg is
    read, so every command (build_py, egg_info, sdist) sees the same list.
    """

    def parse_config_files(self, *args, **kwargs):
        super().parse_config_files(*args, **kwargs)
        if "localrt._schemas" not in self.packages:
            self.packages.append("localrt._schemas")


# Each page goes to its section's folder: man/localrt.1 to share/man/man1, and so on.
setup(distclass=WithSchemas,
      data_files=[(f"share/man/man{n}", sorted(glob.glob(f"man/*.{n}"))) for n in "1579"
                  if glob.glob(f"man/*.{n}")])
