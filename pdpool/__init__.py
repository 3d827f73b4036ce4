"""pdpool: prefill/decode disaggregated LLM serving."""

__version__ = "0.1.0"


# operator/ has no __init__.py, so that it cannot shadow the standard library's `operator`
# for programs started from the repository root. An installed wheel carries it as
# pdpool/operator/; an editable install's finder cannot resolve a folder without
# __init__.py, so in a source checkout the repository root joins this package's path and
# `pdpool.operator` resolves to operator/ as a namespace package.
def _source_checkout_root() -> "str | None":
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    if os.path.isdir(os.path.join(here, "operator")):
        return None
    if os.path.isfile(os.path.join(root, "operator", "operator_cli.py")):
        return root
    return None


_root = _source_checkout_root()
if _root is not None:
    __path__.append(_root)
