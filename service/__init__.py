"""The bnrecal service: recalibration runs, export, jobs, blobs, settings, CLI."""
