"""Starting mmserve: the CLI, each process's config built from the settings, the launcher of one or all
roles and the supervisor that restarts them."""
