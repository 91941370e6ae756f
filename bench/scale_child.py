"""The fila process of the scale case: prepare a job from a project, let the "engine" change
work/, compute the diff. Prints one JSON object: seconds per phase and the peak RSS.

    python -m bench.scale_child ROOT PROJECT TASK_ID FILES_JSON
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    root_dir, project, task_id, files_json = argv
    from bench.common import peak_rss_kb
    from bench.projects import mutate
    from fila.core.layout import Root
    from fila.core.models import Task
    from fila.run import job as cycle
    from fila.workspace import diff, jobdir

    root = Root.at(root_dir)
    task = Task(id=task_id, engine="shell", command="true", targets=["."], project=project)
    checked = cycle.check_task(root, task)
    t = time.perf_counter()
    prep = jobdir.prepare(root, task_id, task, checked.policy, checked.effective)
    prepare_s = time.perf_counter() - t
    mutate(prep.job_dir / "work", json.loads(Path(files_json).read_text()))
    os.sync()
    t = time.perf_counter()
    d = diff.compute_diff(prep.job_dir, policy=checked.policy, scratch=root.meta(task_id) / "scratch")
    diff_s = time.perf_counter() - t
    print(
        json.dumps(
            {
                "prepare": prepare_s,
                "diff": diff_s,
                "files": prep.files,
                "bytes": prep.bytes,
                "diff_files": d.stat.files,
                "patch_bytes": d.bytes,
                "rss_kb": peak_rss_kb(),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
