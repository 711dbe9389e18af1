"""Native libraries' own prints stay off stdout (QNN's libnative writes '# LIBNATIVE: ...' to file descriptor 1
when an HTP session is made), so `--json` output stays JSON."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from workbench.targets.htp import INSTALL, qnn_available

PROBE = """
import json, numpy as np, onnx
from onnx import helper, TensorProto
from workbench.targets.htp import _session, htp_session_options, htp_soc
g = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g",
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]); m.ir_version = 9
onnx.save(m, sys.argv[1])
soc = htp_soc("8gen3")
s = _session(sys.argv[1], htp_session_options(soc), soc)
print(json.dumps({"y": s.run(None, {"x": np.ones((1, 4), np.float32)})[0].tolist()}))
"""


@pytest.mark.skipif(not qnn_available(), reason=f"onnxruntime-qnn is not installed: {INSTALL}")
def test_an_htp_session_prints_nothing_on_stdout(tmp_path):
    done = subprocess.run([sys.executable, "-c", "import sys\n" + PROBE, str(tmp_path / "add.onnx")],
                          capture_output=True, text=True, timeout=300, check=True)
    assert "LIBNATIVE" not in done.stdout
    assert json.loads(done.stdout)["y"][0][0] == pytest.approx(2.0, abs=1e-2)
