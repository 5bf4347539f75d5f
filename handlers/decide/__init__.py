"""The decision engine: every input (an intent, a watch event, a resident update, a tick) comes
in through one entry and goes to the rules that decide it.
"""
