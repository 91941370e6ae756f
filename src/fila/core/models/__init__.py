"""The file formats: task, policy and review record.

These pydantic models are the one source of truth for each format: `fila schema task|policy|record`
prints the JSON Schema generated from them, files are validated against that schema (so errors
name the field; a file these models accept in strict mode is one the schema accepts, and skips it:
policy.validate_document), and `schemas/*.json` in the repository and `_schemas.json` in this
package (read instead of generating the schema in every process) are generated copies tests keep
in sync.

One module per role: `fields` holds the field types the formats share (sizes, counts, times and
the floors and ceilings of every resource), `task`, `policy` and `record` one format each, and
`schema` the schemas generated from them and their stored copy. A format's module imports only
`fields` and the formats it embeds (a record holds its task), so each format reads on its own and
no field type is defined twice. Every public name is re-exported here: callers import from
`core.models`, whichever module a name lives in.
"""

from __future__ import annotations

# The names and ids that need no pydantic live in core/states.py (the CLI imports them at start-up).
from ..states import ID_PATTERN, ErrorKind, Status, valid_id
from .fields import (
    MAX_COUNT,
    MAX_CPUS,
    MAX_NOFILE,
    MAX_PIDS,
    MAX_SIZE,
    MAX_TIMEOUT_MS,
    MIN_CPUS,
    MIN_MEMORY,
    MIN_NOFILE,
    MIN_PIDS,
    MIN_SIZE,
    MIN_TASK_TIMEOUT_MS,
    SIZE_PATTERN,
    Count,
    Cpus,
    LimitSize,
    MemorySize,
    MiB,
    Millis,
    Pids,
    Size,
    TaskMillis,
    now_iso,
    parse_size,
)
from .policy import (
    ENV_NAME_PATTERN,
    HOST_PATTERN,
    HTTP_METHOD_PATTERN,
    ROUTE_PATH_PATTERN,
    RUNTIME_PATTERN,
    SETUP_REGISTRIES,
    SETUP_ROUTE_PATTERN,
    AllowEntry,
    Egress,
    Policy,
    Route,
    SetupPolicy,
    Tmpfs,
)
from .record import (
    Attempt,
    CheckResult,
    CredentialsFound,
    Decision,
    DiffStat,
    EgressRecord,
    EgressRequest,
    EngineReport,
    EnvironmentRecord,
    ErrorInfo,
    ImageRef,
    PolicyRef,
    Record,
    RouteSummary,
    Workspace,
)
from .schema import published_schema, schema_for, write_stored_schemas
from .task import Limits, Task

__all__ = [
    "ENV_NAME_PATTERN",
    "HOST_PATTERN",
    "HTTP_METHOD_PATTERN",
    "ID_PATTERN",
    "MAX_COUNT",
    "MAX_CPUS",
    "MAX_NOFILE",
    "MAX_PIDS",
    "MAX_SIZE",
    "MAX_TIMEOUT_MS",
    "MIN_CPUS",
    "MIN_MEMORY",
    "MIN_NOFILE",
    "MIN_PIDS",
    "MIN_SIZE",
    "MIN_TASK_TIMEOUT_MS",
    "ROUTE_PATH_PATTERN",
    "RUNTIME_PATTERN",
    "SETUP_REGISTRIES",
    "SETUP_ROUTE_PATTERN",
    "SIZE_PATTERN",
    "AllowEntry",
    "Attempt",
    "CheckResult",
    "Count",
    "Cpus",
    "CredentialsFound",
    "Decision",
    "DiffStat",
    "Egress",
    "EgressRecord",
    "EgressRequest",
    "EngineReport",
    "EnvironmentRecord",
    "ErrorInfo",
    "ErrorKind",
    "ImageRef",
    "LimitSize",
    "Limits",
    "MemorySize",
    "MiB",
    "Millis",
    "Pids",
    "Policy",
    "PolicyRef",
    "Record",
    "Route",
    "RouteSummary",
    "SetupPolicy",
    "Size",
    "Status",
    "Task",
    "TaskMillis",
    "Tmpfs",
    "Workspace",
    "now_iso",
    "parse_size",
    "published_schema",
    "schema_for",
    "valid_id",
    "write_stored_schemas",
]
