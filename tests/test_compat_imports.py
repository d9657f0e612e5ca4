"""Import paths from before the subpackages (0.1) keep working for one release, with a warning."""
import importlib
import subprocess
import sys
import warnings

import pytest

from dynamix_hvd._compat import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_new_module_with_a_warning(old):
    new = importlib.import_module(f"dynamix_hvd.{MOVED[old]}")
    sys.modules.pop(f"dynamix_hvd.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(f"dynamix_hvd.{old}")
    assert module is new
    assert any(issubclass(w.category, DeprecationWarning) and MOVED[old] in str(w.message) for w in caught)


def test_old_names_of_the_two_modules_that_became_packages():
    from dynamix_hvd.data import teacher_classification
    from dynamix_hvd.dba import DBAConfig
    from dynamix_hvd.data.synthetic import teacher_classification as new_tc
    from dynamix_hvd.dba.selection import DBAConfig as new_cfg

    assert teacher_classification is new_tc and DBAConfig is new_cfg
    with pytest.raises(AttributeError, match="no_such_name"):
        import dynamix_hvd.data as data
        data.no_such_name


def test_python_m_with_an_old_path_runs_the_new_module():
    out = subprocess.run([sys.executable, "-m", "dynamix_hvd.buildcheck"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "horovod" in out.stdout.lower()
