ALTER TABLE leaders DROP COLUMN resign_term;
