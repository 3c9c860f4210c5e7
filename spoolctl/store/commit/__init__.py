"""The commit path: what a put may hold, and one entry or a group committed manifest-last."""
