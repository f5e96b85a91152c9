"""Metadata lives in setup.cfg; this file only adds the man pages for packagers."""

import glob

from setuptools import setup

setup(data_files=[("share/man/man1", sorted(glob.glob("man/*.1")))])
