"""Test harness only: with ``tests/users/nvrx_import_shim`` on PYTHONPATH, a program written for NVIDIA's
library runs unchanged on ours (see ``inprocess/__init__.py`` here). Nothing else of that package exists."""
