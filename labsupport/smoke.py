"""`python -m labsupport.smoke`: the 2-rank smoke test that `labsupport doctor` launches.

It is `labsupport.runtime`'s smoke test run as a module of its own: `labsupport/__init__` imports
`labsupport.runtime`, and running an already imported module with `-m` makes runpy warn on every rank.
"""
from .runtime import _smoke_test

if __name__ == "__main__":
    _smoke_test()
