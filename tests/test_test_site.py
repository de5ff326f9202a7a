"""tests/_site: what the processes the tests start get (sitecustomize.py)."""

import os
import subprocess
import sys

_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


def test_the_environments_own_sitecustomize_still_runs(tmp_path):
    """The tests' sitecustomize shadows the environment's (a coverage hook, a
    distribution's): it runs that one after its own."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import os\nos.environ['SITE_CHAIN'] = 'ran'\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_SITE, str(other)]))
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get('SITE_CHAIN'))"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ran", out.stderr[-2000:]
