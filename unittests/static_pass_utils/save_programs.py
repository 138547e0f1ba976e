"""Saves real 2-stage rank-0 section programs as .pdmodel files for the CLI tests; writes JSON.

Usage: ``FLAGS_enable_pir_api=0 python unittests/static_pass_utils/save_programs.py OUTDIR OUT.json``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from unittests.static_pass_utils.programs import build_real, op_list  # noqa: E402

out_dir, out = sys.argv[1], sys.argv[2]
main, section, startup = build_real(2, 0, upstream_nop=False)
inner_startup = startup._pipeline_opt["startup_program"]
_, upstream_section, _ = build_real(2, 0, upstream_nop=True)
for name, program in [("section", section), ("startup", inner_startup), ("upstream", upstream_section)]:
    with open(os.path.join(out_dir, f"{name}.pdmodel"), "wb") as f:
        f.write(program.desc.serialize_to_string())
with open(out, "w") as f:
    json.dump({"section": op_list(section), "upstream": op_list(upstream_section)}, f)
