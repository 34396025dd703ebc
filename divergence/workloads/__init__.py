"""What drives the engine for a user: schedules of prompt files (runner), prompt
files, sweeps and the backend probe map."""
