"""``stppo_agent.evaluation.tables``: plain-text column widths."""

from __future__ import annotations

from stppo_agent.evaluation.tables import fixed_width_table


# -- tables.py --------------------------------------------------------------------------------------------------
def test_tables_columns_are_as_wide_as_their_widest_cell_two_spaces_apart():
    table = fixed_width_table(["a", "bbbb", "c"], [["xyz", "1", "22"], ["q", "", "3"]])
    assert table == "a    bbbb  c\n---  ----  --\nxyz  1     22\nq          3"
    assert fixed_width_table(["name"], []) == "name\n----"
