"""The agent DSL (`@function`, gen, select, fork); arrives with the frontend-language issue."""
