"""A prompt longer than the context is one line on stderr: the error, without the tokenizer's
'Token indices sequence length is longer than ...' warning before it."""
from __future__ import annotations

import json
import os
import subprocess
import sys


def test_long_text_prompt_is_one_line(tmp_path):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"id": "r1", "prompt": "hello world " * 3000}) + "\n")
    p = subprocess.run([sys.executable, "-m", "divergence", "run", "--prompts", str(prompts), "--out",
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRANSFORMERS_VERBOSITY": "warning"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2
    assert len(lines) == 1 and lines[0].startswith("divergence run: error: ") and "context" in lines[0], lines
    assert "Token indices" not in p.stderr
