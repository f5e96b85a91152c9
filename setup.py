"""Metadata lives in setup.cfg; this file only adds the man pages for packagers."""

import glob

from setuptools import setup

# Each page goes to its section's folder: man/localrt.1 to share/man/man1, and so on.
setup(data_files=[(f"share/man/man{n}", sorted(glob.glob(f"man/*.{n}"))) for n in "1579"
                  if glob.glob(f"man/*.{n}")])
