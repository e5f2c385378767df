"""The documentation as tested code: its blocks run, its queries run in mongosh, its links and API names exist."""
