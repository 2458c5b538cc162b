import ast
from pathlib import Path

ENTRY = Path(__file__).resolve().parents[3] / "embedserve" / "handler" / "torchserve" / "entry.py"


def test_the_archive_s_entry_module_holds_one_class():
    """TorchServe refuses a handler module that defines more than one class ("Expected only one
    class in custom service code")."""
    tree = ast.parse(ENTRY.read_text())
    assert [node.name for node in tree.body if isinstance(node, ast.ClassDef)] == ["EmbeddingHandler"]
