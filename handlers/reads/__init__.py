"""What people are shown, read from the state: the read API's answers and the operators'
figures. Computed with the rules' own readings; nothing is decided here.
"""
