"""What a run reports from its records: the terminal summary (``summary``), the JSON and Markdown
reports (``report``), the figures (``plots``), the block of declarations a run found its targets need
(``declarations``) and several machines' reports in one table (``merge``)."""
