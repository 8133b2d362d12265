"""CRIU plumbing: version checks and the action script CRIU runs around a dump/restore."""
