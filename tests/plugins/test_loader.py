"""``stppo_agent.plugins.loader``: ``--import`` on every command, plugin files and modules
and their recorded form, one-line reasons, a file imported once under its name, entry points."""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

import pytest

from stppo_agent.plugins import loader


# -- plugins: --import of files and modules --------------------------------------------------------------------------
@pytest.fixture
def clean_imports(monkeypatch):
    """Plugins imported by a test leave sys.modules and sys.path as they were (the next run imports them again)."""
    before_modules, before_path = set(sys.modules), list(sys.path)
    yield
    for name in set(sys.modules) - before_modules:
        del sys.modules[name]
    sys.path[:] = before_path


def test_loader_import_argument_on_every_command():
    parser = argparse.ArgumentParser()
    loader.add_import_argument(parser)
    assert parser.parse_args([]).imports == []
    assert parser.parse_args(["--import", "a.py", "--import", "pkg.mod"]).imports == ["a.py", "pkg.mod"]
    action = next(a for a in parser._actions if a.dest == "imports")
    assert action.metavar == "FILE_OR_MODULE" and action.help == loader.IMPORT_HELP
    assert action.option_strings == ["--import"]
    recorded = argparse.ArgumentParser()
    loader.add_import_argument(recorded, recorded=True)
    help_text = next(a for a in recorded._actions if a.dest == "imports").help
    assert help_text == loader.IMPORT_HELP + " (recorded in the run's config.yaml for --resume and replay)"
    assert loader.IMPORT_HELP.startswith("import a plugin first: a .py file (./myrule.py)")
    assert loader.IMPORT_HELP.endswith("own. Repeatable") and loader.ENTRY_POINT_GROUP == "stppo.plugins"


def test_loader_files_and_modules_and_their_recorded_form(tmp_path, monkeypatch):
    assert loader.is_file_spec("myrule.py") and loader.is_file_spec("plugins/myrule")
    assert not loader.is_file_spec("my_package.my_algos") and not loader.is_file_spec("py")
    monkeypatch.setattr(loader.os, "sep", "\\")
    assert loader.is_file_spec("plugins\\myrule")
    assert loader.is_file_spec("plugins/myrule")  # a forward slash is a path on every system
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert loader.portable_specs(["./a.py", "pkg.mod", "a.py", "~/b.py", "pkg.mod", "sub/../c.py"]) == [
        str(tmp_path / "a.py"), "pkg.mod", str(tmp_path / "home" / "b.py"), str(tmp_path / "c.py")]


def test_loader_reasons_are_one_line():
    assert loader._reason(RuntimeError("no\n  GPU\there ")) == "RuntimeError: no GPU here"
    assert loader._reason(KeyError()) == "KeyError"
    assert loader._reason(SystemExit("")) == "SystemExit"


def test_loader_a_plugin_file_imports_once_under_its_name(tmp_path, monkeypatch, clean_imports):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "m27_helper.py").write_text("VALUE = 41\n")
    (folder / "m27_rule.py").write_text("import m27_helper\nimport builtins\nVALUE = m27_helper.VALUE + 1\n"
                                         "builtins.m27_runs = getattr(builtins, 'm27_runs', 0) + 1\n")
    import builtins

    monkeypatch.setattr(builtins, "m27_runs", 0, raising=False)
    monkeypatch.chdir(tmp_path)
    loader.load_plugins(["plugins/m27_rule.py"])
    assert sys.modules["m27_rule"].VALUE == 42 and sys.modules["m27_rule"].__file__ == str(folder / "m27_rule.py")
    assert sys.path.count(str(folder)) == 1 and sys.path[-1] == str(folder)  # appended: never shadows
    loader.load_plugins([str(folder / "m27_rule.py"), "plugins/../plugins/m27_rule.py"])
    assert builtins.m27_runs == 1 and sys.path.count(str(folder)) == 1
    (folder / "m27_second.py").write_text("")
    loader.load_plugins([str(folder / "m27_second.py")])  # a second file of the same folder
    assert sys.path.count(str(folder)) == 1 and "m27_second" in sys.modules
    other = tmp_path / "other"
    other.mkdir()
    (other / "m27_rule.py").write_text("")
    with pytest.raises(ValueError, match=r"^plugin file " + str(other / "m27_rule.py") + r": a module named "
                                         r"'m27_rule' is already imported \(from " + str(folder / "m27_rule.py")
                                         + r"\); rename the file$"):
        loader.load_plugins([str(other / "m27_rule.py")])
    (other / "sys.py").write_text("")
    with pytest.raises(ValueError, match=r"'sys' is already imported \(from a built-in\); rename the file$"):
        loader.load_plugins([str(other / "sys.py")])


def test_loader_a_plugin_file_that_cannot_be_imported(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^plugin file " + str(tmp_path / "gone.py") + " does not exist$"):
        loader.load_plugins(["gone.py"])
    (tmp_path / "rule.txt").write_text("")
    with pytest.raises(ValueError, match=r"^plugin file " + str(tmp_path / "rule.txt") + " is not a .py file$"):
        loader.load_plugins(["./rule.txt"])
    (tmp_path / "my-rule.py").write_text("")
    with pytest.raises(ValueError, match=r"^plugin file " + str(tmp_path / "my-rule.py") + r": 'my-rule' is not a "
                                         r"valid module name; rename the file \(letters, digits and underscores\)$"):
        loader.load_plugins(["my-rule.py"])
    (tmp_path / "m27_raises.py").write_text("raise RuntimeError('no GPU\\nhere')\n")
    with pytest.raises(ValueError, match=r"^plugin " + str(tmp_path / "m27_raises.py") + " failed to import: "
                                         r"RuntimeError: no GPU here$"):
        loader.load_plugins(["m27_raises.py"])
    assert "m27_raises" not in sys.modules
    (tmp_path / "m27_exits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(ValueError, match=r"failed to import: SystemExit: 3$"):
        loader.load_plugins(["m27_exits.py"])
    assert "m27_exits" not in sys.modules


def test_loader_a_plugin_module_from_the_current_directory(tmp_path, monkeypatch, clean_imports):
    monkeypatch.chdir(tmp_path)
    package = tmp_path / "m27_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "algos.py").write_text("VALUE = 7\n")
    (package / "broken.py").write_text("raise KeyError('bad')\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    loader.load_plugins(["m27_pkg.algos"])
    assert sys.modules["m27_pkg.algos"].VALUE == 7 and sys.path[-1] == str(tmp_path)
    loader.load_plugins(["m27_pkg.algos"])
    assert sys.path.count(str(tmp_path)) == 1
    with pytest.raises(ValueError, match=r"^plugin module 'm27_pkg.broken' \(" + str(package / "broken.py")
                                         + r"\) failed to import: KeyError: 'bad'$"):
        loader.load_plugins(["m27_pkg.broken"])
    with pytest.raises(ValueError, match=r"^cannot import plugin module 'm27_pkg.nothing': no m27_pkg/nothing.py in "
                                         r"the current directory \(" + str(tmp_path) + r"\) and no installed module "
                                         r"of that name; pass a file path \(--import path/to/nothing.py\) or "
                                         r"install it$"):
        loader.load_plugins(["m27_pkg.nothing"])
    (package / "sub").mkdir()
    (package / "sub" / "__init__.py").write_text("")
    with pytest.raises(ValueError, match=r"\(--import path/to/nothing.py\) or install it$"):
        loader.load_plugins(["m27_pkg.sub.nothing"])
    with pytest.raises(ValueError, match=r"^cannot import plugin module 'm27_missing': no m27_missing.py in the "
                                         r"current directory .*\(--import path/to/m27_missing.py\) or install it$"):
        loader.load_plugins(["m27_missing"])
    with pytest.raises(ValueError, match=r"^cannot import plugin module 'm27_nopkg.mod': ModuleNotFoundError: "):
        loader.load_plugins(["m27_nopkg.mod"])
    for bad in (".relative", "a-b", "pkg..mod", "1pkg"):
        with pytest.raises(ValueError, match=r"^plugin '" + bad.replace(".", r"\.") + r"' is neither a module name "
                                             r"\(my_package.my_algos\) nor a .py file$"):
            loader.load_plugins([bad])
    sys.modules["m27_already"] = SimpleNamespace()
    loader.load_plugins(["m27_already"])  # imported already: nothing to find


def test_loader_entry_points_are_imported_once_and_a_broken_one_is_named(monkeypatch):
    loaded, groups = [], []

    def entry_points(group):
        groups.append(group)
        return [SimpleNamespace(name="good", value="pkg.good", load=lambda: loaded.append("good"))]

    monkeypatch.setattr(loader.importlib.metadata, "entry_points", entry_points)
    monkeypatch.setattr(loader, "_loaded_entry_points", False)
    loader.load_plugins()
    loader.load_plugins([])
    assert loaded == ["good"] and groups == ["stppo.plugins"]

    def broken():
        raise ImportError("missing  dependency\nfoo")

    monkeypatch.setattr(loader.importlib.metadata, "entry_points", lambda group: [
        SimpleNamespace(name="bad", value="pkg.bad:x", load=broken)])
    monkeypatch.setattr(loader, "_loaded_entry_points", False)
    with pytest.raises(ValueError, match=r"^stppo plugin 'bad' \(pkg.bad:x\) failed to import: ImportError: missing "
                                         r"dependency foo$"):
        loader.load_plugins()
    assert loader._loaded_entry_points is True
