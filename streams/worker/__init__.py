"""The Faust worker and every adaptation of Faust: nothing else imports Faust."""
