"""The `tokenspeed` command and the launcher process: parse the configuration, start the worker
ranks, hand the process to the Rust core, and watch the children (and, across nodes, relay
plans) while it serves."""
