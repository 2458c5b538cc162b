"""A script in a child Python, for what must not happen in the test process (capping its memory)."""

import json
import os
import subprocess
import sys

from tests.support import REPO


def run_child(tmp_path, script: str, model_dir) -> dict:
    """Run `script` with `model_dir` in a child Python (whose limits it may cap) and return the
    JSON object its last output line holds."""
    path = tmp_path / "child.py"
    path.write_text(script)
    result = subprocess.run([sys.executable, str(path), str(model_dir)], capture_output=True, text=True,
                            timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
