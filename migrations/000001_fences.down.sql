DROP TABLE fences;
