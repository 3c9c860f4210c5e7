"""What a deployment is: settings, rank topology, identity and weights digest, the deployment
directory's own files, the host budget, start-up checks.
"""
