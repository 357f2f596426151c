"""What a run reports from its records: the terminal summary (``summary``), the JSON and Markdown
reports (``report``) and the figures (``plots``)."""
