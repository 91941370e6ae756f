"""Project environments: the project's own toolchain under the engine and the check
(docs/environments.md). `spec` is the one form every declaration becomes, `devcontainer` and
`declare` read where a project declares it, `key` names what a setup depended on, `build` makes
and finds the environment's images."""
