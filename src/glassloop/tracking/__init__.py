"""What a run reports: the run log (metrics files, trackers, the report), the console, the start and
end summaries, reading runs back."""
