"""Maps the repository's folders onto import names under `pdpool`.

The folders keep the layout of the design brief (engine/, operator/, ...) while the import
names (`pdpool.engine`, `pdpool.operator`, ...) can never shadow the standard library.
"""

import os

from setuptools import setup

FOLDERS = {
    "pdpool": "pdpool",
    "pdpool.engine": "engine",
    "pdpool.kernels": "kernels",
    "pdpool.sidecar": "sidecar",
    "pdpool.operator": "operator",
}


def discover():
    packages, package_dir = [], {}
    for name, folder in FOLDERS.items():
        for root, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__"))]
            rel = os.path.relpath(root, folder)
            # A folder's top may lack __init__.py: operator/ must not shadow the stdlib, nor
            # kernels/ Hugging Face's `kernels` package when run from the repository root.
            if "__init__.py" not in files and rel != ".":
                continue
            pkg = name if rel == "." else name + "." + rel.replace(os.sep, ".")
            packages.append(pkg)
            package_dir[pkg] = root
    return packages, package_dir


packages, package_dir = discover()
setup(
    packages=packages,
    package_dir=package_dir,
    include_package_data=True,
    package_data={"pdpool": ["data/*"], "pdpool.kernels": ["csrc/*.c"]},
)
