"""README.md's FastAPI example, as a served app for the schemathesis run (tests/test_openapi_schemathesis.py).

Not a copy: the block is read from README.md at import and run as this
module, so the app under test is the one a reader pastes. Only its Redis URL
changes, to `$REDIS_URL`. Run with
`REDIS_URL=redis://... python -m uvicorn readme_fastapi_app:app` from tests/.
"""

import os
from pathlib import Path

try:
    from ._markdown import python_blocks
except ImportError:
    from _markdown import python_blocks

DOC_URL = "redis://127.0.0.1:6379/0"
README = "README.md"


def readme_app_block() -> tuple[str, int]:
    """(source, line) of README.md's one ```python block that builds a FastAPI app."""
    found = [b.block for b in python_blocks()
             if b.block.path == README and not b.fragment and "app = FastAPI()" in b.block.source]
    assert len(found) == 1, f"README.md should have one FastAPI example, found {len(found)}"
    assert DOC_URL in found[0].source, f"README.md's FastAPI example no longer uses {DOC_URL}"
    return found[0].source, found[0].line


_source, _line = readme_app_block()
# Leading newlines: a traceback names README.md's own line numbers.
exec(compile("\n" * _line + _source.replace(DOC_URL, os.environ.get("REDIS_URL", DOC_URL)),
             str(Path(__file__).resolve().parents[1] / README), "exec"), globals())
